"""fp4lab.train: token data and the built-in corpus, optimizers, the training loop, checkpoints,
receipts and reports. Files: data.py, corpus.py, optim.py, config.py (TrainConfig), run.py (a
run's setup), loop.py, checkpoint.py, lock.py, errors.py (what the command line names without
importing torch), receipt.py (the typed run record), report.py, demo.py, stats.py."""
