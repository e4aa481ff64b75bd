"""python -m services.prefill: one prefill instance (settings from DS_* variables)."""

from services.prefill.service import PrefillService
from services.process import WorkerSettings
from services.runtime import serve
from shared.kv_transfer import enable_notifier_thread

if __name__ == "__main__":
    enable_notifier_thread()  # one event loop for the process's life
    serve("prefill", lambda: PrefillService(WorkerSettings()))
