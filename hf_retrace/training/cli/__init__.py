"""The training commands' plumbing, apart from the training library around it: the argument tables
(``arguments.py``), the checks that run before any model loads (``checks.py``), ``hf-retrace data | train | calibrate``
(``commands.py``) and the training run that ``train`` starts (``train_command.py``)."""
