// CoreDNS for the local node cluster, with only the plugins its Corefile
// uses (devcluster/netstack.py). Upstream's own main imports every plugin,
// and with them the AWS, Azure, Google Cloud and Datadog SDKs: minutes of
// build on two cores for plugins that could never reach their clouds here.
// Same mechanism as upstream's plugin.cfg: the plugins register themselves
// when imported, and Directives says in which order they run.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func init() {
	// A subsequence of upstream's core/dnsserver/zdirectives.go: same order.
	dnsserver.Directives = []string{
		"reload",
		"ready",
		"health",
		"errors",
		"log",
		"loadbalance",
		"cache",
		"kubernetes",
	}
}

func main() {
	coremain.Run()
}
