"""fp4lab.studies: published FP4 findings as data, each runnable with one command."""
