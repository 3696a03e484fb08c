"""deepspeed's home: its record, reader and writer (see :mod:`pipeplan.launchers`); imports nothing."""
