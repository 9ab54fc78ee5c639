"""The live dashboard: the router's metric and decision logs and the GPU service's
``/metrics``, drawn in the browser every second (``spillway dashboard``; ``spillway up``
and ``make demo`` start it). Static files and the charting library are served from this
package."""
