"""The front: one process that speaks HTTP and hands the work to the models' workers.

Four rooms, imports pointing down only (ARCHITECTURE.md):

    api/      the route table, field parsing, the one generation pipeline, a module
              per dialect (parser + formatter), the one error mapping
    serving/  the Service: supersede, the disconnect watcher, counters, shutdown
    models/   a model on the shelf (entry, sessions pool), the shelf and its folder
              scan, the worker client, launching workers from the flags
    httpd/    connections, reading, limits, streams; knows no route (it is handed
              ``api.routes.APP``)

The front never loads libllama: models live in their workers.
"""
