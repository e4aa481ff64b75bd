"""python -m services.profiler: the workload profiler service (settings from DS_*)."""

import asyncio

from services.process import run_until_signalled, setup_logging
from services.profiler.service import ProfilerService, ProfilerSettings

if __name__ == "__main__":
    setup_logging("profiler")
    service = ProfilerService(ProfilerSettings())
    asyncio.run(run_until_signalled(service.run))
