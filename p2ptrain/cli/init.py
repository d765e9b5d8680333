"""`p2ptrain init`: start a run: a signed manifest and its genesis checkpoint."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from p2ptrain.cli.common import CLIError, load_identity
from p2ptrain.run.spec import SPARSE_DEFAULTS


def add_parser(sub) -> None:
    p = sub.add_parser("init", help="start a training run: write DIR/run.toml and the genesis checkpoint")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for run.toml and genesis.p2ck")
    p.add_argument("--name", default="", help="a human-readable name for the run")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "base"])
    p.add_argument("--data", default="stdlib", metavar="SPEC",
                   help="'stdlib' (default), 'glob:path/*.txt' (bytes), 'bin:file' (uint16 token ids), "
                        "'jsonl:GLOB' (a \"text\" field per line), 'parquet:GLOB' (a \"text\" column) or "
                        "'hf:DIR' (datasets save_to_disk); text kinds use --tokenizer")
    p.add_argument("--inner-steps", type=int, default=20, metavar="H")
    p.add_argument("--group-size", type=int, default=4, metavar="G")
    p.add_argument("--outer-lr", type=float, default=None,
                   help="default 0.7 (DiLoCo's); 2.0 for --allreduce sparse, 0.5 for --overlap eager (best measured, BENCHMARKS.md)")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="default 0.9; 0.5 for --allreduce sparse, 0.8 for --overlap eager (best measured)")
    p.add_argument("--inner-lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20, help="inner warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--planned-outer-steps", type=int, default=10, help="horizon of the inner LR schedule")
    p.add_argument("--allreduce", default="int8", choices=["int8", "fp32", "sparse"],
                   help="'sparse': top-k + 2-bit + error-feedback contributions, all-gathered (issue 18)")
    # sparse defaults: the best `bench diloco` configuration (3 seeds, +0.97 % vs int8 DiLoCo at
    # 2,004x fewer bytes than data-parallel; BENCHMARKS.md, issue 18)
    p.add_argument("--topk-fraction", type=float, default=SPARSE_DEFAULTS["topk_fraction"], help="sparse: entries kept per chunk")
    p.add_argument("--chunk", type=int, default=SPARSE_DEFAULTS["chunk"], help="sparse: values per top-k chunk (<= 4096)")
    p.add_argument("--ef-decay", type=float, default=SPARSE_DEFAULTS["ef_decay"], help="sparse: error-feedback decay")
    p.add_argument("--aggregation", default="mean", choices=["mean", "robust"],
                   help="'robust': each chunk's owner combines every member's copy with CenteredClip "
                        "(Byzantine-robust, costs W-1 connections per member)")
    p.add_argument("--overlap", default="none", choices=["none", "delayed", "eager"],
                   help="run step t's all-reduce while step t+1's inner steps train (issue 17): 'delayed' "
                        "keeps training from the local params, 'eager' from the outer step with the local "
                        "pseudo-gradient standing in for the average; the committed state is the same math")
    p.add_argument("--max-inner-steps", type=int, default=None, metavar="N",
                   help="with --overlap: a peer whose phase ends before the previous round landed keeps "
                        "stepping, up to N inner steps, instead of idling for slower peers (default 2 x "
                        "--inner-steps; 0: exactly --inner-steps)")
    p.add_argument("--fragments", type=int, default=None, metavar="P",
                   help="with --overlap: streaming outer steps (issue 17): step t reduces fragment t mod P of "
                        "the parameters and a phase is --inner-steps / P steps, so each round carries 1/P of "
                        "the payload and lands P x sooner; outer step defaults to 0.7 / 0.9 (best measured)")
    p.add_argument("--join-window", type=float, default=30.0,
                   help="longest wait, after the first peer is ready, for the others (a step closes "
                        "earlier once every peer training it is ready)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--key", metavar="FILE", help="initiator's Ed25519 key (default ~/.p2ptrain/node.key)")
    from p2ptrain.train.runinit import add_init_args  # --model hf:PATH, --tokenizer PATH

    add_init_args(p)
    p.set_defaults(func=run)


def build_spec(args, data_hash: str, genesis_sha: str = "", genesis_bytes: int = 0):
    """The run these arguments describe (`p2ptrain.run.spec.RunSpec` owns the schema)."""
    from p2ptrain.run.spec import DataSpec, GenesisSpec, ModelSpec, RunSpec, SpecError, TimeoutsSpec, TrainSpec
    from p2ptrain.train.model import ModelConfig

    prep = getattr(args, "prepared", None)  # p2ptrain.train.runinit: --model hf:, --tokenizer
    model = dict(prep.model) if prep else ModelConfig.preset(args.preset).to_dict()
    if args.seq_len > model["max_seq_len"]:
        raise CLIError(f"--seq-len {args.seq_len} exceeds the {args.preset} preset's {model['max_seq_len']}",
                       "use a smaller --seq-len")
    sparse = args.allreduce == "sparse"
    # eager overlap: the best outer step measured when a round lands late in the next phase
    # (3 seeds: +2.3 % vs synchronous DiLoCo at a whole phase, against +8.5 % with 0.7 / 0.9)
    # Streaming (--fragments) rounds land H / P steps late: DiLoCo's own outer step measured best
    fragments = getattr(args, "fragments", None)
    eager = getattr(args, "overlap", "none") == "eager" and not sparse and not fragments
    lr0, mom0 = (2.0, 0.5) if sparse else (0.5, 0.8) if eager else (0.7, 0.9)
    outer_lr = args.outer_lr if args.outer_lr is not None else lr0
    outer_momentum = args.outer_momentum if args.outer_momentum is not None else mom0
    compressor = dict(topk_fraction=args.topk_fraction, bits=SPARSE_DEFAULTS["bits"], chunk=args.chunk, ef_decay=args.ef_decay) if sparse else {}
    try:
        return RunSpec(
            name=args.name or f"run-{int(time.time())}", created=int(time.time()), model=ModelSpec(model),
            data=DataSpec(args.data, data_hash, **(prep.data_extra if prep else {})),
            train=TrainSpec(seed=args.seed, inner_steps=args.inner_steps, inner_lr=args.inner_lr, warmup=args.warmup,
                            weight_decay=args.weight_decay, batch_size=args.batch_size, seq_len=args.seq_len,
                            schedule="cosine", planned_outer_steps=args.planned_outer_steps, outer_lr=outer_lr,
                            outer_momentum=outer_momentum, group_size=args.group_size,
                            allreduce=args.allreduce, aggregation=args.aggregation, **compressor,
                            overlap=None if getattr(args, "overlap", "none") == "none" else args.overlap,
                            max_inner_steps=_max_inner_steps(args), fragments=fragments),
            timeouts=TimeoutsSpec(join_window=args.join_window, exchange=5.0),
            genesis=GenesisSpec(genesis_sha, genesis_bytes))
    except SpecError as exc:
        raise CLIError(str(exc), "see `p2ptrain init --help`") from None


def _max_inner_steps(args) -> int | None:
    """Overlapped runs extend a phase up to 2 H by default (bench utilization: fixed H left the
    faster peers idle for the slowest one; the extra steps cost no validation loss,
    BENCHMARKS.md); 0 means a fixed H, which is what every other run has (None)."""
    n = getattr(args, "max_inner_steps", None)
    if getattr(args, "overlap", "none") == "none":
        return n or None  # a number here is refused by the spec, with its reason
    return 2 * args.inner_steps if n is None else n or None


def run(args) -> int:
    from p2ptrain.ckpt import checkpoint
    from p2ptrain.run import manifest as mf
    from p2ptrain.train.local import genesis_state
    from p2ptrain.train.runinit import prepare, write_extras

    out = Path(args.out).expanduser()
    if (out / "run.toml").exists():
        raise CLIError(f"{out}/run.toml already exists", "choose another --out directory")
    identity = load_identity(args)
    try:
        args.prepared = prepare(args)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    ds = args.prepared.ds
    draft = build_spec(args, ds.content_hash)
    genesis = genesis_state(draft, args.prepared.weights)
    if draft.train.fragments:
        from p2ptrain.train.fragments import Fragments
        from p2ptrain.train.local import decode_state

        try:
            Fragments(decode_state(genesis)[0]["outer"].numel(), draft.train.fragments)
        except ValueError as exc:
            raise CLIError(str(exc), "use fewer --fragments or a larger model") from None
    signed = mf.sign(draft.with_genesis(checkpoint.sha256(genesis), len(genesis)).to_dict(), identity)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint.write_atomic(out / "genesis.p2ck", genesis)
    write_extras(out, args.prepared)
    rid = mf.write(signed, out)
    print(rid, flush=True)  # stdout is the run id alone: scripts read it with RID=$(p2ptrain init ...)
    _say_next(out, rid)
    return 0


def _say_next(out: Path, rid: str) -> None:
    """What to run next, on stderr (issue 33: init used to end in silence)."""
    print(f"run {rid[:16]}... written to {out} (run.toml, genesis.p2ck). Next, with MADDR the address "
          "`p2ptrain bootstrap` printed first:\n"
          f"  on this machine:  p2ptrain join --bootstrap MADDR --manifest {out / 'run.toml'}\n"
          f"  on the others:    p2ptrain join --bootstrap MADDR --run {rid}", file=sys.stderr)
