"""A child that reports what it was started with (tests/test_forkserver.py): its pid, working
directory, one environment variable, argv, a string's hash, fresh random draws; then it does
what argv[1] says: exit with a code, echo a stdin line, or sleep until signalled."""

import json
import os
import random
import sys
import time

import numpy as np
import torch

what = sys.argv[1]
print(json.dumps({"pid": os.getpid(), "cwd": os.getcwd(), "var": os.environ.get("FORKPROBE"), "argv": sys.argv[1:],
                  "hash": hash("p2ptrain"), "random": random.random(), "np": float(np.random.random()),
                  "torch": float(torch.rand(1)), "sid": os.getsid(0)}), flush=True)
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "echo":
    print(sys.stdin.readline().strip().upper(), flush=True)
elif what == "sleep":
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
elif what == "raise":
    raise RuntimeError("boom")
