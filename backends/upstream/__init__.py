"""What every HTTP upstream shares: the pooled client (`client.py`), settings, timeouts, error mapping and
timed event streams (`http.py`), one SSE reader (`sse.py`), stop strings cut from streamed text (`text.py`)."""
