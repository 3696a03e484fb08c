"""One home per launcher: ``pipeplan.launchers.<name>`` holds what that launcher runs (its record),
how doctor reads its files (its reader) and how a plan is restated in its words (its writer).

The modules carry their own layers (tests/test_layers.py): a record sits at facts' level, a writer
at export's, a reader at doctor's. This face and each launcher's ``__init__`` import nothing, so
that importing a record loads no reader or writer.
"""
