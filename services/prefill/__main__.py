"""python -m services.prefill: one prefill instance (settings from DS_* variables)."""

import asyncio

from services.prefill.service import PrefillService
from services.process import WorkerSettings, built_or_exit, run_until_signalled, setup_logging
from shared.kv_transfer import enable_notifier_thread

if __name__ == "__main__":
    setup_logging("prefill")
    enable_notifier_thread()  # one event loop for the process's life
    service = built_or_exit("prefill", lambda: PrefillService(WorkerSettings()))
    asyncio.run(run_until_signalled(service.run))
