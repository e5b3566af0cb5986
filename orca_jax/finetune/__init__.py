"""Fine-tuning LoRA adapters on the serving device while it serves (FineInfer), and serving the result.

hparams.py (a job's settings), data.py (JSONL datasets, packing), adapter_params.py (the trained adapter
in peft's layout; peft directories), model.py (the training forward and loss on the served decoder),
trainer.py (AdamW, accumulation, compiled programs), deferral.py (Deferred Continuous Batching),
jobs.py (jobs, events, checkpoints on disk), tuner.py (the engine's jobs), job_run.py (the running one),
offline.py (LLM.fine_tune).
"""
