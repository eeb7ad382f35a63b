#!/usr/bin/env bash
# Gathers the wheels that the GPU machine (Python 3.12, x86-64, no network) lacks for
# the peers bench into one folder, small enough to travel with the working tree
# (a few MB): TRL 1.16.0 and what it needs beyond the image (datasets, dill,
# multiprocess), and verl 0.9.1 with what it needs beyond the image, the device bundle
# (Ray) and the SGLang bundle (pyzmq, msgspec, orjson). Every wheel is taken without
# its dependencies; `scripts/gpu_sglang.sh peers` installs them with
# `pip install --no-index --no-deps --target /tmp/peersite`.
#
#   usage, from the project root:  bash bench/peers/bundle.sh [OUT_DIR]   (default .peerbundle)
#   once:                          echo /.peerbundle/ >> .git/info/exclude
set -euo pipefail
OUT=${1:-.peerbundle}
PIP=${PIP:-python3 -m pip}
PLAT="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform any"
TRL="trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19"
# verl's own pins: tensordict <= 0.10.0 (TransferQueue wants >= 0.10.0), hydra-core 1.3
# with omegaconf < 2.4; tensordict needs pyvers < 0.2 and importlib_metadata.
VERL="verl==0.9.1 transferqueue==0.1.11 tensordict==0.10.0 pyvers==0.1.0
  importlib_metadata==8.7.0 torchdata==0.11.0 hydra-core==1.3.8 omegaconf==2.3.0
  codetiming==1.4.0 pylatexenc==2.11"
mkdir -p "$OUT"
# shellcheck disable=SC2086  # word lists
$PIP download -q $PLAT -d "$OUT" $TRL $VERL
# omegaconf and hydra pin antlr4-python3-runtime 4.9.*, published as source only: a
# pure-Python wheel is built from it here.
$PIP wheel -q --no-deps --no-binary=:all: -w "$OUT" antlr4-python3-runtime==4.9.3
ls "$OUT"
du -sh "$OUT"
