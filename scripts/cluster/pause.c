/* The pod sandbox ("pause") process of the real-node cluster (scripts/cluster/build.sh compiles it
 * statically with Debian's gcc and wraps it as registry.k8s.io/pause:<tag>): sleeps until
 * SIGINT/SIGTERM and, as PID 1 of a pod sharing its PID namespace, reaps zombies. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void sigdown(int signo) {
  psignal(signo, "Shutting down, got signal");
  exit(0);
}

static void sigreap(int signo) {
  (void)signo;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    printf("pause (spectrain)\n");
    return 0;
  }
  if (getpid() != 1) fprintf(stderr, "Warning: pause should be the first process\n");
  struct sigaction down = {.sa_handler = sigdown};
  struct sigaction reap = {.sa_handler = sigreap, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &down, NULL) < 0) return 1;
  if (sigaction(SIGTERM, &down, NULL) < 0) return 2;
  if (sigaction(SIGCHLD, &reap, NULL) < 0) return 3;
  for (;;) pause();
  return 42;
}
