"""``spillway serve websocket``: an API Gateway WebSocket API on 127.0.0.1, as strict as
API Gateway.

- ``gateway``: the upgrade and the routes (``$connect``, ``$default``, ``$disconnect``)
  invoked as API Gateway invokes the function, each connection's messages served in
  turn, the idle and lifetime limits, and ``serve``;
- ``throttle``: the stage's throttle and the quota of new connections;
- ``frames``: API Gateway's frame rules (text frames only, 32 KiB a frame) on aiohttp's
  parser, read off each frame's header;
- ``events``: the connections, and the events a handler is given;
- ``management``: the ``@connections`` management API on the same port.
"""
