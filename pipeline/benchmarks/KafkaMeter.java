// The Kafka broker's own request and byte counters, read over JMX for the bench (pipeline/benchmarks/kafkameter.py).
//
// Run with java's single-file source launcher: `java KafkaMeter.java <broker pid>`. It attaches to the broker's
// JVM (the JDK's Attach API: same user, same machine; the broker needs no JMX port or flag), starts its local
// management agent, and then prints one JSON line of counters for every line it reads on stdin, until stdin
// ends. One JVM for the whole bench run: a reading costs the broker a few MBean reads, not a process start.
//
// What it prints (all cumulative since the broker started):
//   requests: request name -> count  (kafka.network:type=RequestMetrics,name=RequestsPerSec, every version summed)
//   bytes_in / bytes_out: record bytes produced to / fetched from the broker's topics
//                         (kafka.server:type=BrokerTopicMetrics,name=BytesInPerSec / BytesOutPerSec)
//   net_in / net_out: bytes its sockets read and wrote, requests and responses whole
//                     (kafka.server:type=socket-server-metrics, incoming-byte-total / outgoing-byte-total)
import com.sun.tools.attach.VirtualMachine;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.Map;
import java.util.TreeMap;
import javax.management.MBeanServerConnection;
import javax.management.ObjectName;
import javax.management.remote.JMXConnector;
import javax.management.remote.JMXConnectorFactory;
import javax.management.remote.JMXServiceURL;

public class KafkaMeter {
  static double number(MBeanServerConnection m, ObjectName name, String attribute) {
    try {
      return ((Number) m.getAttribute(name, attribute)).doubleValue();
    } catch (Exception e) {
      return 0;
    }
  }

  static double sum(MBeanServerConnection m, String pattern, String attribute) throws Exception {
    double total = 0;
    for (ObjectName n : m.queryNames(new ObjectName(pattern), null)) total += number(m, n, attribute);
    return total;
  }

  public static void main(String[] args) throws Exception {
    VirtualMachine vm = VirtualMachine.attach(args[0]);
    String url = vm.startLocalManagementAgent();
    vm.detach();
    try (JMXConnector connector = JMXConnectorFactory.connect(new JMXServiceURL(url))) {
      MBeanServerConnection m = connector.getMBeanServerConnection();
      BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
      System.out.println("{\"ready\": true}");
      System.out.flush();
      while (in.readLine() != null) {
        Map<String, Double> requests = new TreeMap<>();
        for (ObjectName n : m.queryNames(new ObjectName("kafka.network:type=RequestMetrics,name=RequestsPerSec,*"), null)) {
          requests.merge(n.getKeyProperty("request"), number(m, n, "Count"), Double::sum);
        }
        StringBuilder out = new StringBuilder("{\"requests\": {");
        String sep = "";
        for (Map.Entry<String, Double> e : requests.entrySet()) {
          out.append(sep).append('"').append(e.getKey()).append("\": ").append(e.getValue().longValue());
          sep = ", ";
        }
        out.append("}");
        out.append(", \"bytes_in\": ").append((long) number(m,
            new ObjectName("kafka.server:type=BrokerTopicMetrics,name=BytesInPerSec"), "Count"));
        out.append(", \"bytes_out\": ").append((long) number(m,
            new ObjectName("kafka.server:type=BrokerTopicMetrics,name=BytesOutPerSec"), "Count"));
        out.append(", \"net_in\": ").append((long) sum(m,
            "kafka.server:type=socket-server-metrics,*", "incoming-byte-total"));
        out.append(", \"net_out\": ").append((long) sum(m,
            "kafka.server:type=socket-server-metrics,*", "outgoing-byte-total"));
        out.append("}");
        System.out.println(out);
        System.out.flush();
      }
    }
  }
}
