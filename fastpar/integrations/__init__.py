"""fastpar inside the training frameworks people already use: :mod:`.lightning` (``Trainer(strategy="fastpar")``)
and :mod:`.accelerate` (``enable()``: accelerate, and Hugging Face's Trainer on it, build fastpar's DDP)."""
