"""Running stages: the contract a stage implements (`stage`), the run folder and its journals (`folder`),
and the executor that runs stages over a run folder, resumably (`executor`)."""
