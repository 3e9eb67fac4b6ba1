"""`python -m cosyvoice_triton.gateway --triton grpc://host:8001 [--triton ...] [--port 8080]`: a gateway in
front of Triton servers that run elsewhere (`cosyvoice-triton up` runs one server and a gateway together).
`--triton dns://name:8001` routes over every address `name` resolves to, re-resolved as pods come and go
(a Kubernetes headless Service).

SIGTERM / Ctrl-C drains, as `up` does: new requests get 503 with Retry-After and /readyz "draining", the
streams in flight get `--drain-timeout` seconds to finish, then it exits 0 (gateway/drain.py). Give a pod
a `terminationGracePeriodSeconds` above the drain timeout plus a few seconds."""
from __future__ import annotations

import argparse
import logging
import sys

from .config import add_gateway_arguments, config_from_args
from .drain import DRAIN_TIMEOUT_S


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cosyvoice_triton.gateway", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (default: warnings only)")
    parser.add_argument("--model-dir", default=None, help="model folder whose tokenizer prices requests (optional)")
    parser.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S, metavar="S",
                        help="on SIGTERM / Ctrl-C, how long requests in flight may take to finish")
    add_gateway_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    from .app import run

    return run(config, drain_timeout_s=args.drain_timeout)


if __name__ == "__main__":
    sys.exit(main())
