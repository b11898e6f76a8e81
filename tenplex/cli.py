"""The ``tenplex`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from .config import ParallelConfig
from .errors import TenplexError

__all__ = ["main", "human_bytes", "parse_ranks"]


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def parse_ranks(text: str) -> list[int]:
    """'0-3,6,8-9' -> [0, 1, 2, 3, 6, 8, 9]."""
    out: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        a, sep, b = part.partition("-")
        try:
            out.extend(range(int(a), int(b) + 1) if sep else [int(a)])
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot parse rank list {text!r}: use e.g. 0-3,6,8-9") from None
    return out


def _layout(text: str) -> ParallelConfig:
    try:
        return ParallelConfig.parse(text)
    except TenplexError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cmd_plan(args: argparse.Namespace) -> int:
    from .models import model_ptc
    from .planner import plan

    ptc = model_ptc(args.model, optimizer=not args.no_optimizer, distributed_optimizer=args.distributed_optimizer)
    result = plan(ptc, args.from_, args.to, alive=args.alive, gpus_per_host=args.gpus_per_host)
    s = result.stats
    if args.json:
        out = {"model": args.model, "from": str(args.from_), "to": str(args.to), **s.to_json()}
        print(json.dumps(out))
        return 0
    rows = [
        ("bytes needed", s.bytes_needed),
        ("kept local", s.bytes_local),
        ("moved within hosts", s.bytes_same_host),
        ("moved across hosts", s.bytes_cross_host),
        ("from storage", s.bytes_storage),
        ("moved (total)", s.bytes_moved),
        ("lower bound", s.bytes_lower_bound),
        ("max sent by one old rank", s.max_send_bytes),
        ("max received by one new rank", s.max_recv_bytes),
    ]
    print(f"{args.model}: {args.from_} ({args.from_.world_size} GPUs) -> {args.to} ({args.to.world_size} GPUs), "
          f"{len(ptc)} tensors, {human_bytes(ptc.nbytes)}")
    for label, value in rows:
        print(f"  {label:<30} {human_bytes(value):>12}")
    print(f"  {'moves':<30} {s.num_moves:>12}")
    print(f"  {'plan time':<30} {s.plan_seconds:>11.3f}s")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .checkpoint import list_steps, read_manifest

    steps = list_steps(args.url)
    if not steps:
        print(f"no checkpoint steps under {args.url}", file=sys.stderr)
        return 1
    summary = []
    for info in steps:
        summary.append({"step": info.step, "complete": info.complete, "layout": str(info.layout) if info.layout else None,
                        "world_size": info.world_size, "ranks_done": info.ranks_done, "data_bytes": info.nbytes})
    complete = [i.step for i in steps if i.complete]
    manifest = None
    if args.step is not None or complete:
        manifest = read_manifest(args.url, args.step)
    if args.json:
        out: dict[str, object] = {"url": args.url, "steps": summary}
        if manifest is not None:
            ptc = manifest["ptc"]
            out["step"] = manifest["step"]
            out["tensors"] = {n: {"shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."),
                                  "bytes": s.nbytes} for n, s in ptc.tensors.items()}
        print(json.dumps(out))
        return 0
    print(f"{args.url}")
    print(f"  {'step':>10}  {'complete':<8}  {'layout':<24} {'ranks':>9}  {'data':>12}")
    for s in summary:
        ranks = f"{s['ranks_done']}/{s['world_size'] if s['world_size'] is not None else '?'}"
        print(f"  {s['step']:>10}  {'yes' if s['complete'] else 'NO':<8}  {s['layout'] or '?':<24} {ranks:>9}  "
              f"{human_bytes(s['data_bytes']):>12}")
    if manifest is not None:
        ptc = manifest["ptc"]
        model = ptc.meta.get("model", {})
        print(f"step {manifest['step']}: layout {manifest['layout']}, {len(ptc)} tensors, {human_bytes(ptc.nbytes)}"
              + (f", model {model.get('arch')} L={model.get('num_layers')} h={model.get('hidden')}" if model else ""))
        if ptc.objects:
            print(f"  objects: {', '.join(ptc.objects)}")
        names = list(ptc.tensors) if args.tensors else sorted(ptc.tensors, key=lambda n: -ptc.tensors[n].nbytes)[:10]
        if not args.tensors:
            print("  largest tensors (--tensors lists all):")
        for n in names:
            s = ptc.tensors[n]
            print(f"  {n:<50} {str(list(s.shape)):<16} {str(s.dtype).removeprefix('torch.'):<9} {human_bytes(s.nbytes):>12}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tenplex", description="Change the parallelism of a running training job.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan the move of a model's state between two layouts")
    p.add_argument("--model", required=True, help="model preset, e.g. gpt3-175b, llama3-8b, tiny")
    p.add_argument("--from", dest="from_", required=True, type=_layout, metavar="LAYOUT", help="dp=..,tp=..,pp=..")
    p.add_argument("--to", required=True, type=_layout, metavar="LAYOUT", help="dp=..,tp=..,pp=..")
    p.add_argument("--alive", type=parse_ranks, default=None,
                   help="old ranks whose devices survive, e.g. 0-5,8 (default: the first new-world-size)")
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--no-optimizer", action="store_true", help="parameters only, no Adam state")
    p.add_argument("--distributed-optimizer", action="store_true", help="optimizer state sharded across DP")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("inspect", help="list a checkpoint's steps, layouts, completeness and tensors")
    p.add_argument("url", help="checkpoint URL (local path, memory://, s3://, ...)")
    p.add_argument("--step", type=int, default=None, help="step to describe (default: latest complete)")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except TenplexError as e:
        print(f"tenplex {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
