"""The REST face of autoshard (FastAPI on uvicorn): thin routes over the library."""
