// CoreDNS with only the plugins the real-node cluster's Corefile uses (scripts/cluster/cluster.sh):
// the full plugin set pulls in every cloud SDK and costs minutes of a cold build for nothing the
// cluster runs. This is CoreDNS's own recipe for a custom build (coredns.go with a trimmed
// plugin list); `coredns -plugins` lists what is in.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/template"
)

// The plugins in the order of CoreDNS's plugin.cfg (the order a query passes them in).
var directives = []string{"bind", "ready", "errors", "cache", "template", "kubernetes"}

func init() { dnsserver.Directives = directives }

func main() { coremain.Run() }
