"""fp4lab.train: token data and the built-in corpus, optimizers, the training loop, checkpoints,
receipts and reports. Files: data.py, corpus.py, optim.py, loop.py, checkpoint.py, report.py."""
