"""flows: the Prefect flows and their tasks, the plain driver and the CLI; every
Prefect import of the project, and nothing heavy.

A flow function is the DAG and nothing else: ``iteration.run_iteration`` and
``driver.run_iteration`` both walk ``tasks.plan``. The Prefect tasks wrap
Prefect-free work of ``tasks``: ``step_tasks`` (one per step, generated from its
declaration in ``tasks.steps``), ``maintenance_tasks`` and ``evaluation_tasks``.
Config loading (YAML, --set) is in ``flows.config``; artifacts and progress
lines are here.

May import: tasks and everything below, prefect and prefect-ray. Nothing may
import flows.
"""
