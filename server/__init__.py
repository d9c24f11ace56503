"""kvserve's OpenAI-compatible HTTP server over the continuous-batching engine.

    python -m server --model smollm2-135m-instruct --port 8000

`create_app(settings)` builds the FastAPI app; see server/app.py for its lifespan.
"""
