"""`hf-fastpath` command line: env | demo | quantize | eval | bench."""

from __future__ import annotations

import argparse
import logging
import sys


def _add_quantize(sub):
    p = sub.add_parser("quantize", help="quantize a model directory to a GPTQ/AWQ checkpoint")
    p.add_argument("model_dir")
    p.add_argument("out_dir")
    p.add_argument("--method", choices=["gptq", "awq", "rtn"], default="gptq")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--desc-act", action="store_true", help="GPTQ act-order")
    p.add_argument("--gptaq", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ fitted to the float model's outputs (GPTAQ; default on): corrects earlier layers' "
                   "error, about twice the calibration time; --no-gptaq for classic GPTQ")
    p.add_argument("--asym", action="store_true", help="asymmetric (zero point) quantization")
    p.add_argument("--dataset", default=None,
                   help="calibration text: 'mixed' (default: Old Testament + Python language reference), "
                   "'bible-calib', 'python-docs', a text file or a datasets name")
    p.add_argument("--num-samples", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--device", default=None)


def _add_eval(sub):
    p = sub.add_parser("eval", help="perplexity of a (quantized) model on a text set")
    p.add_argument("model_dir")
    p.add_argument("--dataset", default=None, help="text file, datasets name, 'bible' or 'fortunes'")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--attn-implementation", default="fastpath")
    p.add_argument("--device", default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-fastpath", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="which backends this machine has, and why not the others")
    d = sub.add_parser("demo", help="quantize the embedded SmolLM2-135M with GPTQ; perplexity and samples")
    d.add_argument("--method", choices=["gptq", "awq", "rtn"], default="gptq")
    d.add_argument("--bits", type=int, default=4)
    d.add_argument("--device", default=None)
    d.add_argument("--fast", action="store_true", help="fewer calibration samples and eval tokens")
    _add_quantize(sub)
    _add_eval(sub)
    b = sub.add_parser("bench", help="quick timing of attention and W4A16 against their peers on this device")
    b.add_argument("what", nargs="?", choices=["attention", "w4a16", "all"], default="all")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command != "env" else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command == "env":
        from .envinfo import main as run
    elif args.command == "demo":
        from .demo import main as run
    elif args.command == "quantize":
        from .quantization.workflow import quantize_command as run
    elif args.command == "eval":
        from .quantization.workflow import eval_command as run
    else:
        from .bench import main as run
    return run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
