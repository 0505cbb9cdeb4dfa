"""Hugging Face in and out: reading HF Llama folders and titanrush checkpoints as plain weights, the name
mapping between the two, the conversions `titanrush convert` runs, and a safetensors reader and writer.

- `hf`: read checkpoints, HF folders and `.pt` files into model arguments and a full state dict.
- `hf_mapping`: the weight names and permutations between HF Llama (3 and 4) and titanrush.
- `hf_convert`: the conversions that write (`export_hf`, `export_pt`, `import_hf`).
- `pruned`: reading a checkpoint folder that a training run prunes meanwhile (`keep_latest_k`).
- `safetensors_io`: safetensors files read and written without the `safetensors` package.

May import: `checkpoint`, `models`, `data` (tokenizers) and the base modules. Never imports `run`, the
trainer or the tools.
"""
