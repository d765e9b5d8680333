"""A run's DHT records: keys, value codecs and I/O behind one typed object (`RunRecords`).

A layer of its own below `net/`, `ckpt/`, `run/` and `train/`: it imports only the DHT's
record layer and pure codecs, so every package reads and writes records through it without
importing upward (see `p2ptrain.records.board`).
"""

from p2ptrain.records.board import RunRecords
from p2ptrain.records.codecs import DataRecord, Provider, Ready, RecordError, State

__all__ = ["RunRecords", "RecordError", "Ready", "State", "Provider", "DataRecord"]
