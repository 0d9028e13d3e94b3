"""The HTTP/REST front-end (KServe v2 and Triton extensions) on Starlette's router and uvicorn."""
