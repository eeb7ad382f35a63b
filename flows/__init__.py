"""flows: the Prefect flows, the plain driver and the CLI; nothing heavy.

A flow function is the DAG and nothing else: ``iteration.run_iteration`` and
``driver.run_iteration`` both walk ``tasks.plan``. Config loading
(YAML, --set) is in ``flows.config``; artifacts and progress lines are here.

May import: tasks and everything below, and prefect. Nothing may import
flows.
"""
