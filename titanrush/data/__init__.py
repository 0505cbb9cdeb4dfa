"""The data layer: tokenizer, datasets, and the stateful, mesh-invariant loader.

tok = build_tokenizer(cfg.data.tokenizer)
loader = build_dataloader(cfg.data, tokenizer=tok, seq_len=256, local_batch_size=8, dp_rank=0,
                          dp_degree=1, seed=42, split="train", vocab_size=8192)
for batch in loader: ...  # Batch(input_ids, labels, position_ids, document_ids)
"""

from titanrush.data.loader import Batch, DataLoader, build_dataloader, repeats
from titanrush.data.tokenizer import Tokenizer, build_tokenizer

__all__ = ["Batch", "DataLoader", "Tokenizer", "build_dataloader", "build_tokenizer", "repeats"]
