"""python -m services.colocated: one colocated worker (settings from DS_* variables)."""

import asyncio

from services.colocated.service import ColocatedService
from services.runtime import WorkerSettings, run_until_signalled, setup_logging

if __name__ == "__main__":
    setup_logging("colocated")
    service = ColocatedService(WorkerSettings())
    asyncio.run(run_until_signalled(service.run))
