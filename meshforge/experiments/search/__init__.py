"""`meshforge search`: a hyperparameter search over any recipe fields, kept in an Optuna study
(an SQLite file, or any database Optuna reaches), each trial an ordinary run, pruned by its
intermediate objective as it trains."""
