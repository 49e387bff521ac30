// Command kvgate-cluster is a multi-call binary holding a pinned Kubernetes
// control plane and etcd, built from the Go module proxy by
// scripts/build_cluster.sh.
//
// It dispatches on the basename it was invoked as (the build script installs
// symlinks named kube-apiserver, kube-controller-manager, kube-scheduler and
// etcd) or, failing that, on its first argument:
//
//	kube-apiserver --version
//	kvgate-cluster etcd --version
//
// The kubernetes cmd/* packages are package main and cannot be imported, so
// this mirrors their main functions using the importable app packages.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	_ "time/tzdata" // CronJob time zone support, as in the upstream mains

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format registration
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics plugins
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric registration
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

var commands = map[string]func() int{
	"kube-apiserver": func() int {
		return cli.Run(apiserver.NewAPIServerCommand())
	},
	"kube-controller-manager": func() int {
		return cli.Run(controllermanager.NewControllerManagerCommand())
	},
	"kube-scheduler": func() int {
		return cli.Run(scheduler.NewSchedulerCommand())
	},
	"etcd": func() int {
		// etcdmain.Main reads os.Args itself (and exits on error).
		etcdmain.Main(os.Args)
		return 0
	},
}

func names() string {
	n := make([]string, 0, len(commands))
	for k := range commands {
		n = append(n, k)
	}
	sort.Strings(n)
	return strings.Join(n, ", ")
}

func main() {
	name := strings.TrimSuffix(filepath.Base(os.Args[0]), ".exe")
	run, ok := commands[name]
	if !ok && len(os.Args) > 1 {
		if run, ok = commands[os.Args[1]]; ok {
			// Make the component see itself as argv[0]: cobra and etcd parse
			// os.Args[1:] directly.
			os.Args = append([]string{os.Args[1]}, os.Args[2:]...)
		}
	}
	if !ok {
		fmt.Fprintf(os.Stderr, "usage: %s COMMAND [flags]\n  or invoke through a symlink named after the command\ncommands: %s\n", name, names())
		os.Exit(2)
	}
	os.Exit(run())
}
