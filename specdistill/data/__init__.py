"""Data: the arith generator and tokenizer, tokenisation with prompt masking, collation, `TaskDataModule`."""
