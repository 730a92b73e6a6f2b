# Production image. Python 3.13 on purpose: it exercises the audioop-lts path.
FROM python:3.13-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# libpq for psycopg's pool diagnostics; av (aiortc) ships manylinux wheels with its own libs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libpq5 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /srv
COPY pyproject.toml README.md ./
COPY app ./app
COPY telephony ./telephony
COPY tools ./tools
RUN pip install .

# The embedded PostgreSQL refuses to run as root-owned data; run everything unprivileged.
RUN useradd --create-home --uid 10001 voice
USER voice
ENV DATA_DIR=/home/voice/data \
    HOST=0.0.0.0 \
    PORT=8000
EXPOSE 8000
# SIP signalling and RTP (only used when SIP_BIND is set).
EXPOSE 5060/udp 20000-20999/udp

HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
    CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)" || exit 1

ENTRYPOINT ["voice-agent"]
CMD ["serve"]
