"""The OpenAI-compatible HTTP front end of the daemon (`dsv4 serve --http`)."""
