"""STAND-IN for ``python -m sglang.launch_server`` (SGLang needs CUDA; this machine has none).

Takes the launch_server arguments the launcher passes (``--model-path``,
``--host``, ``--port``, ``--tp-size``, ``--weight-version``,
``--mem-fraction-static``, ``--api-key`` and any extras, which it ignores)
and serves the
embedded engine over the same HTTP protocol. It tests the launcher (command
line, readiness wait, logs, stop), not SGLang itself. ``--exit-after-start``
makes it exit with status 3 before serving, to test a failed launch;
``--ignore-sigterm`` makes it ignore SIGTERM, to test the SIGKILL fallback.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--weight-version", default="0")
    ap.add_argument("--mem-fraction-static", type=float, default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--exit-after-start", action="store_true")
    ap.add_argument("--ignore-sigterm", action="store_true")
    args, extra = ap.parse_known_args()
    shown = dict(vars(args), api_key="***" if args.api_key else None)  # never log the token
    print(f"stand-in sglang server: {shown} extra={extra}", flush=True)
    if args.exit_after_start:
        sys.exit(3)
    if args.ignore_sigterm:
        # Blocked, not ignored: uvicorn installs its own SIGTERM handler when it serves,
        # which would replace SIG_IGN; a blocked signal stays pending in every thread
        # started from here on, whatever handler is installed.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    # Only now: it imports torch and transformers, seconds of CPU that a launch
    # failing above (--exit-after-start) does not need.
    from engines.embedded.serve import serve_model

    serve_model(args.model_path, args.host, args.port, args.weight_version, api_key=args.api_key)


if __name__ == "__main__":
    main()
