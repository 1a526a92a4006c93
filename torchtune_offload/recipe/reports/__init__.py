"""What a run reports: memory figures while it trains (``memory``), its DiskLogger file read back
(``disk_log``), and runs side by side (``run_report``)."""
