#!/usr/bin/env bash
# The peers' wheels for an offline GPU machine: `bash benchmarks/carry.sh wheels` (this name
# stays because memfit's "peer not installed" message names it).
exec bash "$(dirname "$0")/carry.sh" wheels
