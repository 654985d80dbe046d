"""A test OTLP/gRPC trace receiver: the collector's TraceService/Export,
served with grpcio and the OTLP schema from PyPI (opentelemetry-proto), on
127.0.0.1 only. It keeps every span with its resource's service.name and
service.instance.id and lets a test wait (on a condition, not a sleep) until
the spans it expects are there."""
import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _attr_value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def attributes(kvs):
    return {kv.key: _attr_value(kv.value) for kv in kvs}


class Span:
    def __init__(self, resource, span):
        self.service = resource.get("service.name")
        self.instance = resource.get("service.instance.id")
        self.name = span.name
        self.trace_id = span.trace_id.hex()
        self.span_id = span.span_id.hex()
        self.parent_span_id = span.parent_span_id.hex()
        self.kind = span.kind
        self.start = span.start_time_unix_nano
        self.end = span.end_time_unix_nano
        self.attributes = attributes(span.attributes)
        self.error = span.status.code == 2

    def __repr__(self):
        return (f"{self.service}/{self.instance} {self.name} trace={self.trace_id} span={self.span_id} "
                f"parent={self.parent_span_id} {self.attributes}")


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, tls=None):
        """tls: (certificate PEM, key PEM) to serve TLS with; None: plaintext."""
        self.spans = []
        self.exports = 0
        self.cv = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        if tls:
            creds = grpc.ssl_server_credentials([(tls[1], tls[0])])
            self.port = self.server.add_secure_port("127.0.0.1:0", creds)
        else:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"127.0.0.1:{self.port}"

    def Export(self, request, context):
        with self.cv:
            self.exports += 1
            for rs in request.resource_spans:
                resource = attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(Span(resource, s))
            self.cv.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout):
        """Waits until predicate(spans) is true; returns the spans either way."""
        deadline = time.time() + timeout
        with self.cv:
            while not predicate(self.spans):
                left = deadline - time.time()
                if left <= 0:
                    break
                self.cv.wait(left)
            return list(self.spans)

    def snapshot(self):
        with self.cv:
            return list(self.spans), self.exports

    def stop(self):
        self.server.stop(0)
