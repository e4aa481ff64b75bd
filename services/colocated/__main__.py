"""python -m services.colocated: one colocated worker (settings from DS_* variables)."""

import asyncio

from services.colocated.service import ColocatedService
from services.process import WorkerSettings, built_or_exit, run_until_signalled, setup_logging

if __name__ == "__main__":
    setup_logging("colocated")
    service = built_or_exit("colocated", lambda: ColocatedService(WorkerSettings()))
    asyncio.run(run_until_signalled(service.run))
