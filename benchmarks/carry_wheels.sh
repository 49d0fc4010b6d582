#!/usr/bin/env bash
# Wheels of the optional peers (memfit/peers.py) for a GPU machine without registry access,
# in the ignored folder .carry/wheels (ckptplan 0.1.0rc1: one 33 KB pure-Python wheel).
# Usage (repository root, with pip and PyPI): bash benchmarks/carry_wheels.sh
# then pass .carry/wheels (or .carry) to the device tool's carry and, on the GPU machine:
#   python3 -m pip install --no-index --no-deps .carry/wheels/*.whl
# --no-deps: ckptplan needs only torch (>=2.5, <2.14), which the GPU machine has. ckptplan
# declares Python < 3.13: on a newer Python pip refuses it, and the ckptplan-F configurations
# of `memfit bench` are recorded as skipped (peer not installed).
set -euo pipefail
mkdir -p .carry/wheels
python3 -m pip download --no-deps --only-binary :all: --dest .carry/wheels "ckptplan==0.1.0rc1"
ls -l .carry/wheels
