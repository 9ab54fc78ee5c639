"""Frame streams over a WebSocket API: frames in, one answer pushed per frame."""
