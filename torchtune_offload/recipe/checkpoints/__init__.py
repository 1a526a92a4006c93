"""A run's checkpoints: step checkpoints saved crash-safely and resumed exactly (``step_checkpoints``,
``resume``, ``atomic_save``), and the distributed recipe's through torch's state-dict API
(``distributed_checkpoints``)."""
