"""A multi-node Ray cluster on one machine, for the multi-node tests: a head and
worker nodes, each a real raylet (``ray start --head`` / ``ray start
--address``), each offering its own custom resources ("GPU host A", ...).

A node can have folders of its own: ``private={path: backing}`` starts it in a
mount namespace of its own (``unshare -m``) with ``backing`` bind-mounted over
``path``, so that path is that node's own disk, as on separate hosts (a
node-local cache, a root only one node sees), while the test reads ``backing``
from outside. ``lose(name)`` SIGKILLs every process of a node (raylet, agents,
workers), as a host that dies. Processes are started with ``services.spawn``
and ended with ``services.stop``; the head's address file goes with it.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

from tests.e2e.services import BIN, _wait, forget_ray_address, free_port, kill_session, spawn, stop

# Node death is noticed after period x threshold of failed health checks (Ray's
# default: 3 s x 5); a lost node's actors are reported dead only then.
HEAD_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "5"}


def can_isolate() -> bool:
    """Whether this machine lets a node have its own mounts (root, or user namespaces)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return probe.returncode == 0


class RayNodes:
    """Head plus named worker nodes; ``address`` is the head's GCS address. The head
    can be one of the hosts (its CPUs, resources and private folders, as ``add``
    takes them): a node start is several processes, seconds of CPU on 2 cores."""

    def __init__(
        self,
        workdir: Path,
        head_cpus: float = 0,
        resources: dict[str, float] | None = None,
        private: dict[str, Path] | None = None,
    ) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        self.procs: dict[str, subprocess.Popen] = {}
        args = ["--head", f"--port={self.port}", *_offers(head_cpus, resources or {})]
        self._start("head", args, {**self.env, **HEAD_ENV}, private or {})

    def add(
        self,
        name: str,
        cpus: float,
        resources: dict[str, float],
        private: dict[str, Path] | None = None,
    ) -> None:
        """Start worker node ``name`` offering ``cpus`` CPUs and ``resources``."""
        args = [f"--address={self.address}", *_offers(cpus, resources)]
        self._start(name, args, self.env, private or {})

    def lose(self, name: str) -> None:
        """The node dies: SIGKILL to every process it runs, at once."""
        proc = self.procs.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        kill_session(proc.pid)
        proc.wait(timeout=10)

    def close(self) -> None:
        """SIGKILL every node's processes, as ``lose`` does: the cluster and what runs on
        it are thrown away, and ``ray start --block`` never ended within ``stop``'s 10 s
        of grace after a SIGTERM (a module's teardown waited 10 s for the head alone)."""
        for name in [n for n in self.procs if n != "head"] + ["head"]:
            proc = self.procs.pop(name, None)
            if proc is not None:
                stop(proc, signals=())
        forget_ray_address(self.port)

    def _start(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        private: dict[str, Path] | None = None,
    ) -> None:
        log = self.workdir / f"ray-{name}.log"
        # No log monitor: every driver here joins with log_to_driver=False, so no one
        # reads what it would forward, and it polls the node's log files all along.
        cmd = [str(BIN / "ray"), "start", "--block", "--disable-usage-stats", *args]
        cmd.append("--include-log-monitor=false")
        if name == "head":
            cmd.append("--include-dashboard=false")
        if private:
            mounts = []
            for path, backing in private.items():
                Path(path).mkdir(parents=True, exist_ok=True)
                Path(backing).mkdir(parents=True, exist_ok=True)
                mounts.append(f"mount --bind {shlex.quote(str(backing))} {shlex.quote(str(path))}")
            script = " && ".join([*mounts, "exec " + shlex.join(cmd)])
            # --propagation private: the binds stay inside this node's namespace.
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script]
        # Ray gives a new raylet 30 s (fixed) to register with the GCS; on a loaded
        # 2-core machine that can pass ("The current node timed out during startup").
        # A node that exits that way is started again, twice at most.
        for attempt in range(3):
            proc = spawn(cmd, env, log)
            self.procs[name] = proc
            try:
                _wait(
                    lambda: "Ray runtime started" in log.read_text(),
                    f"ray node {name}",
                    120,
                    proc,
                    log,
                )
                return
            except RuntimeError as e:
                stop(proc)
                if attempt == 2 or "timed out during startup" not in str(e):
                    raise


def _offers(cpus: float, resources: dict[str, float]) -> list[str]:
    """``ray start`` flags for a node offering ``cpus`` CPUs and ``resources``."""
    return [f"--num-cpus={cpus:g}", f"--resources={json.dumps(resources)}"]
