"""python -m services.decode: one decode instance (settings from DS_* variables)."""

from services.decode.service import DecodeService
from services.process import WorkerSettings
from services.runtime import serve
from shared.kv_transfer import enable_notifier_thread

if __name__ == "__main__":
    enable_notifier_thread()  # one event loop for the process's life
    serve("decode", lambda: DecodeService(WorkerSettings()))
