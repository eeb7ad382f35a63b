"""The project beside the systems a user would pick instead, on the same task.

Each peer trains the task of a project config (``configs/smollm2-gpu.yaml`` by
default: SmolLM2-135M-Instruct on 2-digit additions) with that config's model,
prompts, batch, sampling, learning rate and reward, and each peer's own
defaults for everything else; each writes one JSON in the shape of
``bench.smollm2_learning``'s (``base``, ``walls``, ``rows``) plus its start-up
seconds, machine and versions:

    task.py        the task read from the project config, the held-out greedy
                   evaluation and the result file every runner writes
    trl_grpo.py    TRL's GRPOTrainer (generation by transformers)
    verl_grpo.py   verl's main_ppo with GRPO and SGLang rollouts, as a subprocess
    verl_reward.py the project's reward as verl's compute_score
    compare.py     held-out pass@1 against wall-clock seconds, side by side
    bundle.sh      the wheels the GPU machine lacks, for an offline install

The peers are not dependencies of the project: TRL is the ``peers`` extra,
verl is installed without its dependencies (its pins conflict with the
project's SGLang). Nothing under ``bench/peers`` is imported by the project.
"""
