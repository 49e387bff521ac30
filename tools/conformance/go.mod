// Wrapper module that builds the backend GIE's and Gateway API's conformance suites deploy
// (echo-basic: it answers every request with the pod's name, namespace and the request it got)
// from the Go module proxy, for `make cluster`'s node. Built by scripts/build_cluster.sh.
module kvgate.dev/tools/conformance

go 1.26.0

tool sigs.k8s.io/gateway-api/conformance/echo-basic

require (
	golang.org/x/net v0.55.0 // indirect
	golang.org/x/sys v0.45.0 // indirect
	golang.org/x/text v0.37.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260427160629-7cedc36a6bc4 // indirect
	google.golang.org/grpc v1.81.1 // indirect
	google.golang.org/protobuf v1.36.12-0.20260120151049-f2248ac996af // indirect
	sigs.k8s.io/gateway-api/conformance v1.6.1 // indirect
)
