"""`spectrain`: validate and render SpecTrainJob manifests offline, run them locally, report.

    spectrain validate FILE...   exit 0 if every document is valid, 1 otherwise; one line per
                                 error: FILE: field.path: what is wrong and how to fix it
    spectrain render FILE        the exact objects the operator creates (ownerReferences aside,
                                 and without its Secrets of random keys: <job>-fleet-key, made
                                 once per job, and the per-pod fleet identities
                                 <job>-fleet-id-<generation>-<node>), as a YAML stream
    spectrain run FILE           run the job on this machine (local backend)
    spectrain report RUN_DIR     the run report (timeline, harvest, losses)
    spectrain generate ...       speculative decoding with an HF model and an exported drafter
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import yaml


def _validate(args: argparse.Namespace) -> int:
    from spectrain_operator import spec

    bad = 0
    for where, error in spec.iter_errors(args.files):
        print(f"{where}: {error}")
        bad += 1
    if not bad and not args.quiet:
        print(f"ok: {len(args.files)} file(s) valid")
    return 1 if bad else 0


def _render(args: argparse.Namespace) -> int:
    from spectrain_operator import builders, spec

    docs = spec.load_manifests(args.file)
    objects = []
    for idx, doc in enumerate(docs):
        errors = spec.validate(doc)
        if errors:
            where = args.file if len(docs) == 1 else f"{args.file}#{idx}"
            for error in errors:
                print(f"{where}: {error}", file=sys.stderr)
            return 1
        job = spec.defaulted(doc)
        if args.namespace:
            job["metadata"]["namespace"] = args.namespace
        try:
            objects += builders.render(job, drafter_disabled=args.without_drafter)
        except ValueError as exc:
            print(f"{args.file}: {exc}", file=sys.stderr)
            return 1
    sys.stdout.write(yaml.dump_all(objects, Dumper=_BlockDumper, sort_keys=False, width=120))
    return 0


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the rendered config.json) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


def _run(args: argparse.Namespace) -> int:
    from spectrain_operator.local import run_main  # lazy: another module, not needed by validate

    return int(run_main(args))


WORKLOADS_MISSING = ("spectrain {command} runs the workloads, which this installation lacks (the operator image "
                     "ships none): install them with pip install 'spectrain[workloads]'")


def _report(args: argparse.Namespace) -> int:
    try:
        from spectrain_workloads.report import main as report_main  # lazy: matplotlib
    except ImportError as exc:
        raise SystemExit(f"{WORKLOADS_MISSING.format(command='report')} ({exc})") from exc
    return int(report_main(args) or 0)


def _generate(args: argparse.Namespace) -> int:
    try:
        from spectrain_workloads.generate import main as generate_main  # lazy: torch, transformers
    except ImportError as exc:
        raise SystemExit(f"{WORKLOADS_MISSING.format(command='generate')} ({exc})") from exc
    return int(generate_main(args))


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """`spectrain generate`'s flags (spectrain_workloads.generate reads them)."""
    p.add_argument("--model", required=True, help="Hugging Face model directory (the target)")
    p.add_argument("--drafter", required=True, help="drafter export root or v<N> directory")
    p.add_argument("--prompt", default=None, help="one prompt")
    p.add_argument("--prompts", default=None, help="file with one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-tokens", type=int, default=4,
                   help="most drafted tokens per verification (1..32); the adaptive controller picks 0..K per step")
    p.add_argument("--compare", action="store_true",
                   help="also decode without the drafter: speedup_vs_plain (median of interleaved pairs, warm-up excluded)")
    p.add_argument("--repeats", type=int, default=5, help="--compare: interleaved speculative/plain pairs (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spectrain", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check manifests offline (schema, CEL rules, semantic checks)")
    v.add_argument("files", nargs="+", metavar="FILE")
    v.add_argument("-q", "--quiet", action="store_true", help="print nothing when everything is valid")
    v.set_defaults(func=_validate)
    r = sub.add_parser("render", help="print the objects the operator would create, as YAML (all but the "
                                      "Secrets of random keys the operator generates: the fleet key, "
                                      "the per-pod fleet identities)")
    r.add_argument("file", metavar="FILE")
    r.add_argument("-n", "--namespace", default=None, help="namespace to render into (default: the manifest's)")
    r.add_argument("--without-drafter", action="store_true",
                   help="render the pods as after a RestartWithoutDrafter action")
    r.set_defaults(func=_render)
    run = sub.add_parser("run", help="run a SpecTrainJob locally (processes instead of pods)")
    run.add_argument("file", metavar="FILE")
    run.add_argument("--run-dir", default=None, help="where checkpoints, metrics and logs go (default runs/<name>)")
    run.add_argument("--resume", action="store_true", help="continue a stopped run in --run-dir")
    run.add_argument("--baseline", action="store_true", help="also run without the drafter, for the report")
    run.add_argument("--report", action="store_true", help="write the report when the run succeeds")
    run.add_argument("-q", "--quiet", action="store_true", help="no live progress")
    run.set_defaults(func=_run)
    rep = sub.add_parser("report", help="build the report of a run directory")
    rep.add_argument("run_dir", metavar="RUN_DIR")
    rep.set_defaults(func=_report)
    gen = sub.add_parser("generate", help="lossless speculative decoding: an HF model + an exported drafter")
    add_generate_arguments(gen)
    gen.set_defaults(func=_generate)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
