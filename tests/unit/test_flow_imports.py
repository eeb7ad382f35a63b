"""Importing a flow's modules loads no torch and no transformers (about 2.5 CPU s
a process). Every ``prefect deploy``, deployment run, ``prefect-rl`` command and
rerun imports them in a fresh process; one that never touches an engine or the
trainer (a refused run, ``prefect deploy``) then never pays for them. A process
that does still loads both on its first engine or trainer: Ray imports an actor's
class to create it or to make its handle (``ray.get_actor``), and the tokenizer
imports transformers. An import of a torch module for a type, a constant or an
error class brings them back into every process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY_MODULES = ("flows.rl_training", "flows.evaluation", "flows.maintenance_flows", "flows.cli")
HEAVY = ("torch", "transformers")

# A fresh interpreter: the test process itself has imported torch long before.
PROBE = f"""
import sys
for name in {ENTRY_MODULES!r}:
    __import__(name)
print(" ".join(m for m in {HEAVY!r} if m in sys.modules))
"""


def test_the_flow_entry_modules_import_neither_torch_nor_transformers():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert loaded == [], (
        f"importing {', '.join(ENTRY_MODULES)} loaded {', '.join(loaded)}: find the chain with "
        f"`python -X importtime -c 'import flows.rl_training'` and move what the flow side "
        f"needs into a torch-free module (e.g. training.types, engines.types)"
    )
